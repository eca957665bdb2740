"""Pipeline parallelism: schedules as data, point-to-point transfers, the executor."""
