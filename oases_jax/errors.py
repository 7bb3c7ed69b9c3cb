"""The one exception type for bad user input: scripts print its message as one line and exit 2."""


class UserError(ValueError):
    """Bad input from a user (flag, mesh, shape, path, checkpoint).

    The message must be a single line that names the offending value and says how to fix it.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
