"""A repository rule that builds the project's Python virtualenv from lock files.

Why a repository rule: Bazel 4.2.3 (Debian's bazel-bootstrap) has no rules_python
and the machines reach no mirror, so the hermetic interpreter is built here with
pip from PyPI and registered as the Python toolchain. The venv lives in Bazel's
output base and is rebuilt only when a lock file, the interpreter or pip's
environment changes.
"""

_BUILD = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "python_toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

# The venv's site-packages, for tools that need a path (e.g. tests that build a
# second environment on top of it).
exports_files(["site_packages_path.txt"])
"""

def _run(rctx, args, what, log):
    rctx.report_progress(what)
    result = rctx.execute(args, timeout = 3600, quiet = True)
    rctx.file(log, result.stdout + result.stderr, executable = False)
    if result.return_code != 0:
        fail("python_venv: {} failed (exit {}).\n--- stdout ---\n{}\n--- stderr ---\n{}".format(
            what,
            result.return_code,
            result.stdout[-4000:],
            result.stderr[-4000:],
        ))
    return result

# The Python versions dsv4 supports: pyproject.toml's requires-python (">=3.11,<3.13"), the one statement of
# it; //tests:docs_test holds this list to it. (Not read from pyproject.toml here: any edit of that file
# would then rebuild the venv.)
SUPPORTED_PYTHON = ["3.11", "3.12"]

# requirements.lock is installed in batches of this many pins, so the first build shows its progress.
BATCH = 12

def _find_python(rctx):
    """The first of ``interpreters`` on PATH whose version is supported; any other is refused by name."""
    seen = []
    for name in rctx.attr.interpreters:
        path = rctx.which(name)
        if not path:
            continue
        result = rctx.execute([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], quiet = True)
        version = result.stdout.strip()
        if result.return_code == 0 and version in SUPPORTED_PYTHON:
            return path
        seen.append("{} ({})".format(path, version or "does not run"))
    fail("python_venv: no supported Python (3.11 or 3.12, pyproject.toml) among {}; found: {}. Fix: install Python 3.11.".format(
        ", ".join(rctx.attr.interpreters),
        ", ".join(seen) or "none",
    ))

def lock_pins(text):
    """The ``name==version`` lines of a lock file's text (comments and blank lines dropped)."""
    pins = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            pins.append(line)
    return pins

def batches(pins, size):
    """``pins`` in consecutive lists of at most ``size``."""
    return [pins[i:i + size] for i in range(0, len(pins), size)]

def _python_venv_impl(rctx):
    python = _find_python(rctx)
    lock = rctx.path(rctx.attr.lock)
    no_deps_lock = rctx.path(rctx.attr.no_deps_lock)
    venv = rctx.path("venv")
    _run(rctx, [python, "-m", "venv", str(venv)], "creating the virtualenv", "logs/venv.log")
    vpython = str(venv) + "/bin/python"
    pip = [vpython, "-m", "pip", "install", "--no-input", "--disable-pip-version-check"]
    pins = lock_pins(rctx.read(lock))
    parts = batches(pins, BATCH)
    done = 0
    for i, part in enumerate(parts):
        # -c: every dependency a batch pulls in takes its locked version too
        _run(
            rctx,
            pip + ["-c", str(lock)] + part,
            "pip install batch {}/{} ({}{}): {} of {} packages of requirements.lock installed".format(
                i + 1,
                len(parts),
                " ".join(part[:3]),
                " ..." if len(part) > 3 else "",
                done,
                len(pins),
            ),
            "logs/pip-{}.log".format(i + 1),
        )
        done += len(part)
    _run(
        rctx,
        pip + ["--no-deps", "--ignore-requires-python", "-r", str(no_deps_lock)],
        "pip install --no-deps -r requirements-nodeps.lock (megatron-core)",
        "logs/pip-nodeps.log",
    )
    site = _run(
        rctx,
        [vpython, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        "locating site-packages",
        "logs/site.log",
    ).stdout.strip()
    rctx.file("site_packages_path.txt", site + "\n", executable = False)
    rctx.file("BUILD.bazel", _BUILD.format(python = vpython), executable = False)

python_venv = repository_rule(
    implementation = _python_venv_impl,
    attrs = {
        "lock": attr.label(mandatory = True, allow_single_file = True),
        "no_deps_lock": attr.label(mandatory = True, allow_single_file = True),
        "interpreters": attr.string_list(default = ["python3.11", "python3"]),
    },
    environ = [
        "PATH",
        "PIP_FIND_LINKS",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "PIP_CONSTRAINT",
    ],
)
