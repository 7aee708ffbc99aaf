"""A Toxiproxy-compatible TCP fault proxy in asyncio, split by job.

``gojson`` decodes and encodes JSON the way Toxiproxy's Go handlers do, ``netaddr`` resolves and binds
addresses like Go's ``net`` package, ``channel`` and ``toxics`` are the per-link toxic pipeline,
``link`` and ``proxy`` the connection engine, ``api`` and ``httpd`` the HTTP API, ``metrics`` the
Prometheus text. The runnable entry point is :mod:`drills.stack.toxiproxy_server`.
"""
