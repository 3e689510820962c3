"""An honest marker for capabilities that exist in the plan but not yet in code.

Raised by factories and launcher stages that are registered (so the CLI,
the combination table and `dsv4 plugins` are complete) but whose work is not
implemented yet. The launcher turns it into a clear message and a non-zero exit.
"""


class NotBuiltError(RuntimeError):
    def __init__(self, what: str, tracking: str):
        super().__init__(f"{what} is not built yet ({tracking}); nothing was run.")
        self.what = what
        self.tracking = tracking
