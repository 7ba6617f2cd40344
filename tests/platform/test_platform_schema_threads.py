"""The schema the control plane builds for itself (every request's query parameters are checked against
it) is built once per process, and building it from several requests at once in a fresh process fails
none of them: drf-spectacular's lazy loading of its extensions is not thread-safe."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, threading
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django
    django.setup()
    from controlplane.common.openapi import full_schema
    errors, barrier = [], threading.Barrier(8)

    def build():
        barrier.wait()
        try:
            full_schema()
        except Exception as error:
            errors.append(repr(error))

    threads = [threading.Thread(target=build) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(len(errors), errors[:1])
    """
)


def test_a_fresh_process_builds_its_schema_from_eight_threads_at_once_without_an_error():
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(["platform", "."])}
    environment.setdefault("DIPTYCH_SECRET_KEY", "tests-only-insecure-key")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=environment, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "0 []", result.stdout
