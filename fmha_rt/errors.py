"""Exception hierarchy of fmha_rt.

Every error derives from FmhaError and also from the builtin a caller would naturally catch, so that
`except ValueError` keeps working for code written against other attention libraries.
"""


class FmhaError(Exception):
    """Base class of every error raised by fmha_rt."""


class FmhaValueError(FmhaError, ValueError):
    """An argument has the right kind but a bad value (shape, range, stride, ...)."""


class FmhaTypeError(FmhaError, TypeError):
    """An argument has the wrong kind (an array where a scalar belongs, a wrong dtype, ...)."""


class FmhaRuntimeError(FmhaError, RuntimeError):
    """Something failed at run time outside the caller's arguments (missing files, no driver, ...)."""


class FmhaNotImplementedError(FmhaError, NotImplementedError):
    """A valid combination of options that no kernel supports yet."""


class DriverError(FmhaRuntimeError):
    """A GPU driver call failed. Carries the driver's error name, the call, the kernel and the device."""

    def __init__(self, message, *, code=None, error_name=None, call=None, kernel=None, device=None):
        super().__init__(message)
        self.code = code
        self.error_name = error_name
        self.call = call
        self.kernel = kernel
        self.device = device
