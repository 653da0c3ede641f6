"""Errors a user can act on.

Every error raised for a user mistake names the problem and the fix in one line, so that the command line can print
it without a traceback. Internal bugs stay ordinary exceptions.
"""


class GromError(Exception):
    """Base class of the errors that the `grom` command prints as a one-line message."""


class UnsupportedArchitectureError(GromError):
    """The model family is not known to the adapter, or a hand-given module name does not exist."""


class ShapeMismatchError(GromError):
    """Tensors handed to the solver or the influence audit have incompatible shapes."""


class NonFiniteError(GromError):
    """A key, target or statistic holds NaN or Inf (usually an overflowing half-precision forward pass)."""


class FingerprintMismatchError(GromError):
    """An edit or a statistic is used on a model whose weights are not the ones it was computed for."""


class DataError(GromError):
    """Input data is empty, malformed, or has no supervised positions."""


class TiedWeightsError(UnsupportedArchitectureError):
    """An edited module shares its weight with another (a tied LM head and input embedding): untie it first."""


class MissingUndoError(GromError):
    """A revert without the undo record of the edit it reverts."""


class ParamsError(DataError):
    """A parameter value that the method cannot take: an unknown name, a wrong type or a value out of range."""
