"""The one error type the CLI turns into a one-line message and an exit code."""


class UserError(Exception):
    """Bad input or an impossible request: the message says what is wrong and what to do.

    `exit_code` is the process exit status the CLI uses (2 for usage-like errors by default).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
