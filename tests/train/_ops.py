"""A dispatch mode that records which aten ops ran: tests assert which kernels a step used."""

from torch.utils._python_dispatch import TorchDispatchMode


class RecordedOps(TorchDispatchMode):
    """Inside ``with RecordedOps() as ops:``, ``ops.names`` collects the name of every aten op that runs."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))
