"""The throwaway PostgreSQL server of tests/pg.py works: a table round-trips, and two worker processes share one
Optuna study through it (what the sweep's tests rely on, issue 60)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pg import postgres_server, postgres_url  # noqa: F401  (fixtures)


def test_a_table_round_trips(postgres_server, postgres_url):  # noqa: F811
    dbname = postgres_url.rsplit("/", 1)[1]
    assert postgres_url == f"postgresql+psycopg2://postgres@127.0.0.1:{postgres_server.port}/{dbname}"
    assert postgres_server.port != 5432  # its own port: a cluster the Debian package started is left alone
    conn = postgres_server.connect(dbname)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE t (id serial PRIMARY KEY, name text)")
            cur.executemany("INSERT INTO t (name) VALUES (%s)", [("a",), ("b",)])
        with conn.cursor() as cur:
            cur.execute("SELECT name FROM t ORDER BY id")
            assert cur.fetchall() == [("a",), ("b",)]
    finally:
        conn.close()


def test_each_test_gets_a_fresh_database(postgres_server, postgres_url):  # noqa: F811
    conn = postgres_server.connect(postgres_url.rsplit("/", 1)[1])
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'")
            assert cur.fetchone() == (0,)
    finally:
        conn.close()


WORKER = """
import sys, optuna
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.load_study(study_name="s", storage=optuna.storages.RDBStorage(sys.argv[1]))
study.optimize(lambda trial: trial.suggest_float("x", 0.0, 1.0) ** 2, n_trials=3)
"""


def test_two_processes_share_an_optuna_study(postgres_url):  # noqa: F811
    optuna = pytest.importorskip("optuna")
    optuna.create_study(study_name="s", storage=optuna.storages.RDBStorage(postgres_url))
    workers = [
        subprocess.Popen([sys.executable, "-c", WORKER, postgres_url], stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for w in workers:
        _, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
    study = optuna.load_study(study_name="s", storage=optuna.storages.RDBStorage(postgres_url))
    trials = study.get_trials(deepcopy=False)
    assert sorted(t.number for t in trials) == list(range(6))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
