"""LM head + cross-entropy: statistics of the logits in the logits GEMM's epilogue, and the
gradient of the logits, either from a recomputed GEMM or from logits stored by the forward."""

import coda_cute as cc


@cc.epilogue
def cross_entropy_stats(acc, target: cc.RowVec):
    """Per row: log-sum-exp of the logits and the target's logit (target: class indices, int32).

    loss = lse - target_logit, finished from the partials; the logits never reach memory.
    """
    return {
        "lse": cc.row_logsumexp(acc),
        "target_logit": cc.row_sum(cc.where(acc.col == target, acc, 0.0)),
    }


@cc.epilogue
def cross_entropy_stats_save(acc, target: cc.RowVec):
    """As cross_entropy_stats, and also store the logits (input dtype) for the backward pass.

    The statistics are taken of the stored, rounded logits, so exp(logits - lse) over a stored
    row sums to 1, as it does for torch's cross-entropy of bf16 logits.
    """
    logits = acc.to(cc.input_dtype)
    return {
        "logits": logits,
        "lse": cc.row_logsumexp(logits),
        "target_logit": cc.row_sum(cc.where(acc.col == target, logits, 0.0)),
    }


@cc.epilogue
def cross_entropy_exp_save(acc, shift: cc.RowVec, target: cc.RowVec):
    """Per row: the sum of exp(logit - shift) and the target's logit, with each exp(logit - shift)
    stored (input dtype) for the backward pass, instead of the logit.

    ``shift`` (fp32) anchors each row's exponentials, so lse = shift + log(sumexp), and the
    gradient of the logits is (stored - onehot(target) * sumexp) * dloss / sumexp: a row scale of
    the stored values, which the backward's GEMMs take as they are, with no pass over them.  The
    sum is taken of the stored, rounded values, so each stored row's gradient sums to 0.
    `linear_cross_entropy` anchors a row at its target's logit plus 60 (its docstring gives the range).
    """
    e = cc.exp(acc - shift).to(cc.input_dtype)
    return {
        "exp": e,
        "sumexp": cc.row_sum(e),
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


@cc.epilogue(a_transform="softmax_grad")
def cross_entropy_dh(acc, lse: cc.RowVec, target: cc.RowVec, dloss: cc.RowVec):
    """dh of the LM head from the logits the forward stored: A = the logits (tokens, vocab), B =
    the weight read as (d, vocab), so acc = dlogits @ W.

    The mainloop turns each logit into its gradient, (exp(logit - lse) - onehot(target)) * dloss,
    as A is loaded (the A transform softmax_grad, a token per row): the logits stay as stored.
    """
    return acc


@cc.epilogue(a_transform="softmax_grad")
def cross_entropy_dw(acc, lse: cc.KVec, target: cc.KVec, dloss: cc.KVec):
    """dW of the LM head from the logits the forward stored: A = the logits' transpose (vocab,
    tokens), B = h read as (d, tokens), so acc = dlogits.T @ h; a token per index of K."""
    return acc
