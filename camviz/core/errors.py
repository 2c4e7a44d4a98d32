"""The exception type that camviz raises for user mistakes, and its warnings.

Every message says what was wrong and what to do about it, in one line, so that the CLI
can print it as it is and exit non-zero without a traceback.
"""


class CamvizError(Exception):
    """A mistake in what camviz was asked to do (bad name, bad file, bad argument)."""


class NonFiniteError(CamvizError):
    """NaN or Inf where a map needs numbers: in a model's scores, activations or gradients.

    It belongs to the inputs that produced it, so a run over many inputs records it for
    those inputs and goes on with the others.
    """


class ModelError(CamvizError, RuntimeError):
    """The user's model raised an exception while camviz ran it; the original is the
    ``__cause__``.

    It belongs to the inputs the model was given, like :class:`NonFiniteError`: a run over
    many inputs records it for them and goes on. It is a ``RuntimeError`` too, as most
    failures of a model are, so code that caught the model's own ``RuntimeError`` still
    catches it.
    """


class ZeroMapWarning(RuntimeWarning):
    """Some maps are all zero: the explained score has no positive evidence at the layer.

    Such a map is an answer, not a failure (after the ReLU of the CAM formulas, evidence
    against the class is dropped), but a picture of it shows nothing; ``relu=False`` shows
    the signed map. The folder job records it in the manifest instead of warning.
    """


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none).

    Third-party errors can span several lines; a CamvizError quotes only this part, so
    that it stays one line.
    """
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
