"""A free local TCP port, for the tests that start their own servers and rendezvous (JupyterLab, SLURM, srun tasks)."""
import socket


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; free again once this returns)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
