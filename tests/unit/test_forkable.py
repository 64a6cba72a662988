"""Which commands the zygote may fork (launch/forks.forkable, pure) and what it refuses
to fork with (launch/zygote.unsafe)."""

from __future__ import annotations

import json
import subprocess
import sys

from fastft.launch.procs.forks import forkable

PY = sys.executable
BASE = {"PYTHONPATH": "/src"}


def test_a_script_or_module_of_the_same_python_forks():
    assert forkable([PY, "train.py", "--steps", "3"], dict(BASE), PY, BASE) is None
    assert forkable([PY, "-m", "pkg.train", "--", "x"], dict(BASE), PY, BASE) is None


def test_anything_else_spawns_with_the_reason():
    assert "not a script of" in (forkable(["/bin/bash", "run.sh"], BASE, PY, BASE) or "")
    assert "not a script of" in (forkable([PY], BASE, PY, BASE) or "")
    assert "interpreter flags (-X)" in (forkable([PY, "-X", "dev", "t.py"], BASE, PY, BASE) or "")
    assert "interpreter flags (-m)" in (forkable([PY, "-m"], BASE, PY, BASE) or "")
    other = {"PYTHONPATH": "/elsewhere"}
    assert "PYTHONPATH differs" in (forkable([PY, "t.py"], other, PY, BASE) or "")
    assert "PYTHONHASHSEED differs" in (
        forkable([PY, "t.py"], {**BASE, "PYTHONHASHSEED": "0"}, PY, BASE) or ""
    )


_UNSAFE = """
import json, socket, threading
from fastft.launch.procs.zygote import unsafe
out = [unsafe()]
stop = threading.Event()
t = threading.Thread(target=stop.wait, name="loader", daemon=True)
t.start()
out.append(unsafe())
stop.set()
t.join(timeout=5)
a, b = socket.socketpair()
out += [unsafe(), unsafe(own=a.fileno())]
a.close()
b.close()
out.append(unsafe())
print(json.dumps(out))
"""


def test_a_thread_or_a_socket_makes_a_fork_unsafe():
    """(In a fresh process: the test process holds the other tests' threads and sockets.)"""
    p = subprocess.run(
        [sys.executable, "-c", _UNSAFE], capture_output=True, text=True, timeout=60, check=True
    )
    clean, thread, two, one, after = json.loads(p.stdout)
    assert clean is None and after is None
    assert "'loader' (started by threading)" in thread
    assert "2 socket(s)" in two and "1 socket(s)" in one


def test_the_zygote_preloads_jax_for_a_script_that_imports_it(tmp_path):
    from fastft.launch.procs.forks import script_imports

    py = sys.executable
    for src in (
        "import jax\n",
        "import fastft.jax\n",
        "from jax import numpy\n",
        "from fastft import jax as fj\n",
        "  import jax.numpy as jnp\n",
    ):
        (tmp_path / "s.py").write_text("import os\n" + src)
        assert script_imports((py, str(tmp_path / "s.py"))) == ("jax", "fastft.jax"), src
    (tmp_path / "t.py").write_text("import jaxtyping\n# import jax\nx = 'import jax'\n")
    assert script_imports((py, str(tmp_path / "t.py"))) == ()
    assert script_imports((py, "-m", "fastft.demo.train_jax")) == ("jax", "fastft.jax")
    assert script_imports((py, "-m", "fastft.demo.train")) == ()
    assert script_imports((py, "-m", "no.such.module")) == ()
    assert script_imports(("/bin/sh", "run.sh")) == ()
