"""User-facing errors: the CLI prints their message on one line and exits with status 2."""


# onnx-lowbit is not on PyPI: every message that says how to get it says this.
INSTALL = ("install onnx-lowbit from its source checkout (it is not on PyPI): pip install \".[cpu]\" or \".[gpu]\" "
           "in the repository, or pip install the wheel that python -m build writes to dist/")


class LowbitError(Exception):
    """A problem with the user's input (file, model, option) that we can name clearly."""
