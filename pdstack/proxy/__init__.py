"""pdstack.proxy: the P/D-aware, prefix-aware, streaming OpenAI front door.

Modules: ``backends`` (discovery: backend table, health state, pairings, generations),
``routing`` (bounded-load consistent hashing, power of two choices, prefix index),
``metrics`` (Prometheus), ``app`` (aiohttp server and the two-leg flow), ``config``
(settings, secrets from env), ``cli`` (``pdstack proxy``).
"""
