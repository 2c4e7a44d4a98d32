"""The one exception type that camviz raises for user mistakes.

Every message says what was wrong and what to do about it, in one line, so that the CLI
can print it as it is and exit non-zero without a traceback.
"""


class CamvizError(Exception):
    """A mistake in what camviz was asked to do (bad name, bad file, bad argument)."""
