"""The three kinds of failure a user can meet, each raised before any compiler runs.

Messages name the program node or operand in the user's terms, what was given and
what was expected.
"""


class CodaError(Exception):
    """Base class of every error coda-cute raises on purpose."""


class ProgramError(CodaError, ValueError):
    """The epilogue program itself is malformed (bad name, type, width, reduction use...)."""


class UnsupportedError(CodaError, NotImplementedError):
    """The program is valid but this configuration (arch, dtype, tile, layout) is not supported."""


class ArgumentError(CodaError, ValueError):
    """A runtime argument (tensor or scalar) does not fit the program or the kernel."""
