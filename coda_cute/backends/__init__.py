"""What the lowering asks of a GPU generation: one ``Backend`` per ``KernelConfig.arch``.

The program and the per-pair value code (``lower``) are the same on every arch; a backend owns
what its kernels' layout decides:

- the *fragment scheme*: which accumulator values a thread holds at one step of the epilogue's
  pair loop (its lanes and their (row, col)), how many threads share a row or a column, and how
  their partial reductions are exchanged (shuffles, a shared-memory scratch);
- the *threads and schedules*: warpgroups per tile, register budgets, MMA blocks per thread;
- the *shared-memory plan*: the subtile width and the stage counts that fit its SM, and the
  bytes its template's SharedStorage takes;
- where it runs and how it is written: the compute capability and the template.

``backends.registry`` maps each arch to its backend; ``backends.sm90`` is Hopper's,
``backends.sm100`` Blackwell's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

from ..config import KernelConfig
from ..program import Program


class Backend(ABC):
    """One GPU generation's kernel layout, as the lowering and the call side need it."""

    #: the ``KernelConfig.arch`` it builds, and the (major, minor) compute capability it runs on
    arch: str
    capability: tuple[int, int]
    #: the GPUs' generation, as messages name it
    generation: str
    #: the template (in ``templates/``) that renders its kernels
    template: str
    #: the (tile, cluster, schedule) its kernels take where a caller fixes none of them; None:
    #: the runtime's rules, measured on Hopper (``runtime.default_tile``)
    defaults: tuple | None = None
    #: what ``autotune`` times besides the rules' choice, (tile, cluster, schedule)
    tune_shapes: tuple = ()
    #: the accumulator's values at one step of the pair loop, as the per-pair code reads them
    acc_lanes: tuple[str, ...]
    #: where the pair loop indexes a ring's view, which is of the subtile's stage (made per subtile)
    ring_lanes: tuple[str, str]
    #: a pair's place among a subtile's pairs in a table's register fragment
    table_slot: str
    #: how many rows a thread holds in the pair loop (per-row registers), and which one it is at
    row_registers: str
    row_register: str
    #: which threads share a row's values (a comment in the emitted code)
    row_sharing: str
    #: the index of the 8-column group the pair loop is at, within the tile
    column_group: str
    #: per-thread registers of a column reduction over one subtile, and which threads share a column
    column_registers: str
    column_sharing: str

    def default_cluster(self, tile: tuple[int, int]) -> tuple[int, int]:
        """The cluster a kernel of ``tile`` takes where none is given (with ``defaults``)."""
        return tuple(self.defaults[1])

    def cta_tile(self, tile: tuple[int, int]) -> tuple[int, int]:
        """The rows and columns of ``tile`` that one CTA's epilogue covers: the unit of the
        persistent scheduler's tile indices, of row vectors in smem and of per-tile partials (the
        whole tile, unless a CTA pair shares the tile's MMA)."""
        return tuple(tile)

    @abstractmethod
    def tile_threads(self, config: KernelConfig) -> int:
        """Threads that compute one tile's epilogue."""

    def epilogue_slot(self, config: KernelConfig) -> tuple[int, str]:
        """(how many tiles run their epilogues at once in a CTA, which one this thread's is): the
        smem words a tile's first thread fills for the tile's other threads."""
        return 1, "0"

    @abstractmethod
    def schedule(self, config: KernelConfig) -> dict:
        """The template's constants for ``config.schedule`` (warpgroups, register budgets)."""

    @abstractmethod
    def plan_smem(self, program: Program, config: KernelConfig, declare: Callable) -> tuple:
        """(context, EPI_STAGES, IN_STAGES, AB_STAGES) that fit the SM's shared memory, where
        ``declare(epi_n)`` gives the context with its tensors declared for subtiles of ``epi_n``
        accumulator columns; UnsupportedError where nothing fits."""

    @abstractmethod
    def smem_bytes(self, ctx, epi_stages: int, in_stages: int, ab_stages: int) -> int:
        """Bytes of the template's SharedStorage under that plan."""

    @abstractmethod
    def coordinates(self, row: bool, col: bool) -> list[str]:
        """Lines that define ``row`` and ``col`` (the pair's first column) where the body reads them."""

    @abstractmethod
    def row_shuffle(self, value: str) -> str:
        """``value`` of the partner thread at one step of ``row_partials``' exchange."""

    @abstractmethod
    def row_partials(self, name: str, partial: str, read: list[str], fold: list[str], write: list[str]) -> list[str]:
        """Lines that, for each row this thread holds, ``read`` its per-thread value, ``fold`` in
        those of the other threads sharing the row (``row_shuffle``), and ``write`` the tile's
        ``partial`` of output ``name`` once per row (``row`` defined)."""

    @abstractmethod
    def row_fold(self, fold: list[str]) -> list[str]:
        """Lines that run ``fold`` (which reads partners' values through ``row_shuffle``) once per
        exchange step among the threads sharing a row (none where a thread holds whole rows)."""

    @abstractmethod
    def segment_registers(self, acc_cols: int, tile_n: int) -> tuple[str, str]:
        """(how many registers a segment reduction over ``acc_cols`` accumulator columns takes per
        thread, which of them holds the segment of the pair at the pair loop's step): one per
        row and segment that one pass of ``segment_pass`` covers."""

    @abstractmethod
    def segment_pass(self, acc_cols: int, body: list[str]) -> list[str]:
        """Lines that run ``body`` (a segment reduction's update at one pair: the accumulator
        lanes, ``pair0`` and ``pair1`` defined) for every pair of this thread's rows in the
        segments one pass covers."""

    @abstractmethod
    def segment_scope(self, acc_cols: int, label: str, init: list[tuple[str, str]],
                      lines: list[str]) -> tuple[list[str], list[str]]:
        """Where a segment reduction runs: (lines of the tile's prologue, lines at the start of a
        subtile, once its accumulator is in registers), given its registers' ``init`` (pairs of a
        declaration and a reset) and its ``lines`` (``segment_pass`` and the fold over the
        threads sharing a row); ``label`` names it in a comment."""

    @abstractmethod
    def column_slot(self, reg: str, lane: int) -> str:
        """This thread's register of ``reg`` (``column_registers`` of them) for the column of
        accumulator lane ``lane`` at the pair loop's step, within a subtile."""

    @abstractmethod
    def column_exchange(self, kind: str, reg: str, epi_n: int, offset: str = "") -> list[str]:
        """Lines that fold a subtile's per-thread column values ``reg`` over the threads sharing
        each column and park each warp's totals in ``col_scratch`` from ``offset``."""

    @abstractmethod
    def table_value(self, frag: str, slot: str) -> str:
        """The entry ``slot`` of table fragment ``frag`` that the pair loop reads (the subtile's)."""

    @abstractmethod
    def table_gather(self, tables: list[dict], slot: Callable, read: Callable) -> list[str]:
        """Lines that load subtile ``gather_subtile``'s table values into their fragments;
        ``slot(lanes, k)`` is lane k's fragment row, ``read(table, col)`` one element."""
