"""The coordinator: schedules step closures onto workers and survives worker and PS failures.

Embedded in a training program (`ClusterCoordinator`), or run as a daemon (`pscluster coordinator`)
that separate client processes submit closures to (`RemoteCoordinator`, same API).

    coord = ClusterCoordinator(settings)
    value = coord.schedule(step_fn, args=(iterator,))
    coord.join(); print(value.fetch())
"""
