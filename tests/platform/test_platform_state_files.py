"""The embedded SQLite database holds password hashes and usage: only its owner may read it."""

import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def migrate(state_dir: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in {"DATABASE_URL", "CELERY_BROKER_URL"}}
    env["DIPTYCH_STATE_DIR"] = str(state_dir)
    # A umask that would leave new files readable by everyone, as most systems set it.
    command = f"umask 022 && exec {sys.executable} manage.py migrate --noinput"
    subprocess.run(["sh", "-c", command], cwd=REPO_ROOT, env=env, check=True, capture_output=True, timeout=300)


def test_migrate_creates_a_private_state_dir_and_database(tmp_path):
    state_dir = tmp_path / "state"
    migrate(state_dir)
    database = state_dir / "controlplane.sqlite3"
    assert mode_of(state_dir) == 0o700
    assert mode_of(database) == 0o600
    # The write-ahead log and its index exist while a connection is open; SQLite creates them with the
    # database file's mode.
    previous_umask = os.umask(0o022)
    try:
        connection = sqlite3.connect(database)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("CREATE TABLE IF NOT EXISTS probe (x)")
            connection.commit()
            side_files = [database.with_name(database.name + suffix) for suffix in ("-wal", "-shm")]
            assert {path.name: mode_of(path) for path in side_files} == {path.name: 0o600 for path in side_files}
        finally:
            connection.close()
    finally:
        os.umask(previous_umask)


def test_migrate_tightens_an_existing_world_readable_database(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o755)
    database = state_dir / "controlplane.sqlite3"
    database.touch(mode=0o644)
    os.chmod(state_dir, 0o755)
    os.chmod(database, 0o644)
    migrate(state_dir)
    assert (mode_of(state_dir), mode_of(database)) == (0o700, 0o600)
