"""kvguard with real engines and real services: the tests marked ``engine`` that run SGLang or
vLLM on CPU (conftest.py's ``engine_scope`` groups them for ``--dist loadscope``), and the chains
through a real Redis, Prometheus and Alertmanager."""
