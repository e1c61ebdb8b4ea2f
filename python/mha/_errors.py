"""The exceptions of libmha's statuses (include/mha.h, mha_status).

Every libmha failure raises a subclass of MhaError carrying
mha_last_error()'s message; ``err.status`` is the numeric status.  Each
class also derives from the Python exception a caller would expect
(ValueError for bad values and shapes, OSError for files, ...), so
``except ValueError`` catches a shape mismatch.
"""


class MhaError(Exception):
    """A libmha call failed.  args: (message, status)."""

    status = None

    def __init__(self, message="", status=None):
        super().__init__(message)
        if status is not None:
            self.status = status

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class MhaNullPointerError(MhaError, ValueError):
    status = 1


class ConfigError(MhaError, ValueError):
    """MHA_ERR_INVALID_CONFIG: an impossible module configuration."""
    status = 2


class InvalidArgumentError(MhaError, ValueError):
    """MHA_ERR_INVALID_ARGUMENT: a value out of its range."""
    status = 3


class ShapeError(MhaError, ValueError):
    """MHA_ERR_SHAPE: tensor shapes do not fit together."""
    status = 4


class MhaOverflowError(MhaError, OverflowError):
    """MHA_ERR_OVERFLOW: a size product does not fit in 64 bits."""
    status = 5


class MhaMemoryError(MhaError, MemoryError):
    """MHA_ERR_OUT_OF_MEMORY."""
    status = 6


class NotFoundError(MhaError, LookupError):
    """MHA_ERR_NOT_FOUND: no parameter of that name."""
    status = 7


class NonFiniteError(MhaError, ValueError):
    """MHA_ERR_NON_FINITE: NaN or Inf where a finite value is due."""
    status = 8


class MhaIOError(MhaError, OSError):
    """MHA_ERR_IO: reading or writing a file failed."""
    status = 9

    def __init__(self, message="", status=None):
        OSError.__init__(self, message)
        if status is not None:
            self.status = status


class FormatError(MhaError, ValueError):
    """MHA_ERR_FORMAT: a file is malformed."""
    status = 10


class UnsupportedError(MhaError, NotImplementedError):
    """MHA_ERR_UNSUPPORTED: valid, but not supported by this build."""
    status = 11


class CommError(MhaError, RuntimeError):
    """MHA_ERR_COMM: communication between processes failed (libmha_mpi;
    never raised by the single-process library this package binds)."""
    status = 12


BY_STATUS = {c.status: c for c in (
    MhaNullPointerError, ConfigError, InvalidArgumentError, ShapeError,
    MhaOverflowError, MhaMemoryError, NotFoundError, NonFiniteError,
    MhaIOError, FormatError, UnsupportedError, CommError)}
