"""What every pdserve service stands on, and nothing above it: the gRPC server lifecycle
(``server``: health, drain), channels (``channels``: options, pools), Prometheus ``metrics``,
proto <-> engine conversion (``convert``), and the one lease-release client
(``lease_release``). Imports ``engine`` and ``pdserve.v1`` only."""
