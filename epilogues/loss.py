"""LM head + cross-entropy statistics without storing the logits."""

import coda_cute as cc


@cc.epilogue
def cross_entropy_stats(acc, target: cc.RowVec):
    """Per row: log-sum-exp of the logits and the target's logit (target = class index as a float).

    loss = lse - target_logit, finished from the partials; the logits never reach memory.
    """
    return {
        "lse": cc.row_logsumexp(acc),
        "target_logit": cc.row_sum(cc.where(acc.col == target, acc, 0.0)),
    }


@cc.epilogue
def cross_entropy_bwd(acc, lse: cc.RowVec, target: cc.RowVec, dloss: cc.RowVec):
    """d logits of cross-entropy from recomputed logits: (softmax - onehot(target)) * dloss.

    The gradient of the per-row loss lse - logit[target], with softmax = exp(logits - lse);
    `lse` comes from cross_entropy_stats, `dloss` is the per-row gradient (0 for ignored rows).
    """
    prob = cc.exp(acc - lse)
    return cc.where(acc.col == target, prob - 1.0, prob) * dloss
