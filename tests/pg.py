"""A real, throwaway PostgreSQL server for the tests (issue 60): the fixtures `postgres_server` (one per session) and
`postgres_url` (a fresh database on it per test).

The server is a cluster made with `initdb` in a temporary directory, listening only on 127.0.0.1 on a free port
(so a cluster the Debian package started on 5432 is never touched), with its Unix socket in that directory, trust
authentication and fsync off. PostgreSQL refuses to run as root, so as root `initdb`, the server and `pg_ctl` run as
the `postgres` OS user (`runuser -u postgres --`). The binaries are looked for on PATH and then in Debian's
/usr/lib/postgresql/<version>/bin (`.ci/run` installs the package when neither has them). The server is stopped
(`pg_ctl stop -m immediate`) and the directory removed at the end of the session, whatever the tests did.

Where no server can be started (no binaries, no psycopg2 to talk to it, root without `runuser` or a `postgres`
user, or a start that fails) the tests that use these fixtures are skipped, and the reason says which.

A test module uses them by importing them: `from pg import postgres_url  # noqa: F401` (pytest puts tests/ on
sys.path; `postgres_url` pulls in `postgres_server`).
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

OS_USER = "postgres"  # who runs the server when the tests run as root; also the database superuser's name
HOST = "127.0.0.1"
INSTALL_HINT = "install PostgreSQL (Debian: apt-get install postgresql; .ci/run does it)"


def find_bin_dir() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres: initdb's on PATH (symlinks followed), else the newest Debian
    /usr/lib/postgresql/<version>/bin that has both; None when there is none."""
    candidates = []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(os.path.realpath(on_path)).parent)

    def version(d: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", Path(d).parent.name)) or (0,)

    candidates += [Path(d) for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)]
    for d in candidates:
        if all(os.access(d / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres")):
            return d
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    """A running throwaway server: connect as `user` on `host`:`port` without a password."""

    host: str
    port: int
    user: str
    directory: Path

    def url(self, dbname: str = "postgres") -> str:
        """The SQLAlchemy URL of a database on this server (what Optuna's RDBStorage takes)."""
        return f"postgresql+psycopg2://{self.user}@{self.host}:{self.port}/{dbname}"

    def connect(self, dbname: str = "postgres"):
        import psycopg2

        return psycopg2.connect(host=self.host, port=self.port, user=self.user, dbname=dbname, connect_timeout=10)


class _Cluster:
    """initdb, start and stop, each as the right OS user."""

    def __init__(self, bin_dir: Path, as_user: list[str]):
        self.bin_dir = bin_dir
        self.as_user = as_user  # ["runuser", "-u", "postgres", "--"] as root, else []
        self.directory = Path(tempfile.mkdtemp(prefix="trainer2-pg-"))
        self.data = self.directory / "data"
        self.log = self.directory / "server.log"
        self.process: subprocess.Popen | None = None
        if as_user:
            shutil.chown(self.directory, user=OS_USER, group=None)

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        # cwd: the postgres user may not be able to read the directory pytest runs in, and pg_ctl looks it up
        return subprocess.run(
            [*self.as_user, *argv], cwd=self.directory, capture_output=True, text=True, timeout=timeout
        )

    def init(self) -> str | None:
        """None on success, else why not."""
        r = self.run(
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            OS_USER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        if r.returncode != 0:
            return f"initdb failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-800:]}"
        return None

    def start(self, port: int) -> str | None:
        """None when the server is up and taking connections on `port`, else why not.

        The server runs as a child of this process (not daemonized by `pg_ctl start`), so that when it stops it is
        reaped here at once, not left a zombie for init to collect."""
        argv = [
            *self.as_user, str(self.bin_dir / "postgres"), "-D", str(self.data), "-p", str(port),
            "-k", str(self.directory), "-c", f"listen_addresses={HOST}",
            "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
        ]  # fmt: skip
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(argv, cwd=self.directory, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        # Ready when the server says so in its postmaster.pid (as pg_ctl -w checks), not when something answers on the
        # port: a server that lost the port to another process must not pass for up.
        deadline = time.monotonic() + 60
        while self.process.poll() is None and time.monotonic() < deadline:
            try:
                status = [line.strip() for line in (self.data / "postmaster.pid").read_text().splitlines()[7:8]]
            except OSError:
                status = []
            if status == ["ready"]:
                return None
            time.sleep(0.05)
        failed = "exited" if self.process.poll() is not None else "did not report itself ready within 60 s"
        self.stop()
        log = self.log.read_text(errors="replace").strip()[-800:]
        return f"the server {failed}: {log}"

    def stop(self) -> None:
        """Stop the server (immediate shutdown) and wait for it; safe to call twice."""
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is None:
            try:
                pg_ctl = str(self.bin_dir / "pg_ctl")
                self.run(pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
                process.wait(timeout=30)
            except (OSError, subprocess.SubprocessError):
                process.kill()  # runuser (or the server itself); the server then goes when its parent does
                process.wait()

    def close(self) -> None:
        """Stop the server and remove its directory; safe to call twice."""
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def why_no_server(bin_dir: Path | None) -> str | None:
    """Why no server can be started here before even trying (None when it may be)."""
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return "psycopg2 is not installed, so the tests cannot talk to PostgreSQL (pip install -e '.[sweep]')"
    if bin_dir is None:
        where = "on PATH or in /usr/lib/postgresql/*/bin"
        return f"no PostgreSQL server binaries (initdb, pg_ctl, postgres) {where}: {INSTALL_HINT}"
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            return "running as root, PostgreSQL refuses to run as root, and there is no runuser to run it as postgres"
        try:
            import pwd

            pwd.getpwnam(OS_USER)
        except KeyError:
            return f"running as root, PostgreSQL refuses to run as root, and there is no '{OS_USER}' OS user to run it"
    return None


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server for the whole session (a PostgresServer); skips, saying why, where none can be started."""
    bin_dir = find_bin_dir()
    reason = why_no_server(bin_dir)
    if reason:
        pytest.skip(reason)
    as_user = ["runuser", "-u", OS_USER, "--"] if os.geteuid() == 0 else []
    cluster = _Cluster(bin_dir, as_user)
    atexit.register(cluster.close)  # also when the session ends without running its teardown
    try:
        reason = cluster.init()
        for _ in range(3 if reason is None else 0):
            port = free_port()  # free when looked at; another process may take it before the server binds it
            reason = cluster.start(port)
            if reason is None or "Address already in use" not in reason:
                break
        if reason:
            pytest.skip(f"could not start a PostgreSQL server: {reason}")
        yield PostgresServer(host=HOST, port=port, user=OS_USER, directory=cluster.directory)
    finally:
        cluster.close()


@pytest.fixture
def postgres_url(postgres_server):
    """The SQLAlchemy URL (postgresql+psycopg2://postgres@127.0.0.1:PORT/t<uuid>) of a fresh, empty database that
    is dropped after the test; skips where no server can be started."""
    name = f"t{uuid.uuid4().hex}"
    admin = postgres_server.connect()
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        yield postgres_server.url(name)
        with admin.cursor() as cur:
            # FORCE ends the connections a test left open (its workers' pools); PostgreSQL 13 and later
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.close()
