"""A bounded chaos run: `python -m bench.chaos --duration 60` (see docs/benchmarks.md, "Chaos run").

Starts the control plane, its jobs process (the Celery worker that runs batches), 2 prefill + 2 decode
workers of `diptych-tiny` and one split gateway on loopback (`harness`), with two organizations that each
stream completions from a few concurrent clients (`load`) and submit Batch API work now and then,
cancelling some of it (`batch_load`). Every few seconds a random victim (a prefill worker, a decode worker,
the gateway, the control plane or the jobs process) is killed with SIGKILL and restarted after a short
random pause (`faults`); the gateway keeps its state directory (its usage spool) across restarts. When the
load has stopped, every process is back, every batch has ended and the gateway's usage has drained to the
control plane (`drain`), the ledger is read (`database`) and compared, request id by request id, with what
the clients received (`ledger`), and line by line with what the batches' output and error files report
(`batch_files`, `batch_ledger`). `report` prints the figures; `run` is the command, `options` its command
line. Exits with status 1 when usage was lost, doubled, billed to the wrong organization, key or tier, or
billed for a batch line reported as not run.
"""
