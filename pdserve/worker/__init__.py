"""The shell every worker shares (``service.WorkerService``): one engine behind gRPC, its stats,
request accounting, and its membership in the cluster. Above ``pdserve.common`` and
``pdserve.cluster``, below the prefill and decode services."""
