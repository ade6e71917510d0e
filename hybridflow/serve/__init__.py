"""The training service with the Tinker API (``hybridflow serve``, docs/serve.md): the REST layer (app.py), the
sessions, models, futures and bounds (service.py), the wire formats (wire.py, messages.py) and the saved paths
(storage.py). It drives the worker of workers/adapter_service.py; clients never reach the worker directly."""
