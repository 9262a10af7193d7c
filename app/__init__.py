"""The top of pdserve: the command line, settings (the only reader of argv and the environment),
the components it builds from typed configs, the local cluster, embedded Redis, the client,
make-model, Ray deployments and the benchmark. Only this package imports the services."""
