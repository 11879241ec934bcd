"""``kvserve serve`` binds its port before it loads the model: a port in use is an error at once."""

import socket
import subprocess
import sys


def test_port_in_use_fails_before_the_model_loads():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        taken.close()
    assert proc.returncode == 2
    # the one line printed: nothing was loaded (loading logs its own lines first)
    assert proc.stderr.splitlines() == [
        f"error: --host 127.0.0.1 --port {port}: cannot listen there: Address already in use"
    ]
