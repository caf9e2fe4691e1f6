"""The parts of ``bench/chaos.py``, one concept each.

- ``fake``: the fake vLLM that fails on request (an engine failure in a stream, a dropped connection);
- ``calls``: one call in each API's grammar, and whether its client got a whole answer;
- ``hostile``: the hostile and broken calls, and the Slowloris connections;
- ``faults``: the processes (the fake, ``tracetrain serve``), vLLM killed and started again, the disk filled;
- ``verdict``: the store read against what the clients saw, and the report.
"""
