"""The browser tests drive the same team setup as tests/infra (servers on PostgreSQL, deployments, a cpu worker).

The fixtures are imported from tests/infra/conftest.py; in a session that runs both folders each
folder starts its own servers (pytest binds a fixture to the conftest that defines it).
"""

from tests.infra.conftest import cpu_worker, deployed, team_servers  # noqa: F401  (fixtures)
