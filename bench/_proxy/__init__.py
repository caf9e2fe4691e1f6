"""The parts of ``bench/proxy_overhead.py``, one concept each.

- ``options``: the targets, the modes and the run's options;
- ``servers``: the fake vLLM, tracetrain and LiteLLM processes, and waiting for them to be idle;
- ``wrk``: the load generator, its invocation and its result line;
- ``probe``: raw HTTP at concurrency 1, the answer check and time to first streamed byte;
- ``runs``: the warm-up and the mode x concurrency x target matrix, with the CPU each process used;
- ``records``: the store's rows against the requests answered;
- ``pyspy``: tracetrain's profile under load;
- ``report``: the tables, the verdicts and the JSON file.
"""
