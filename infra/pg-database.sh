#!/usr/bin/env bash
# Create a PostgreSQL database if it does not exist (idempotent): infra/pg-database.sh NAME
# Server and user from infra/env.sh (EAGLEOPS_PG_HOST/PORT/USER).
set -euo pipefail
source "$(dirname "$0")/env.sh"
name="${1:?usage: $0 DATABASE_NAME}"
[[ "$name" =~ ^[a-z_][a-z0-9_]{0,62}$ ]] || { echo "pg-database: '$name' is not a plain lowercase database name" >&2; exit 2; }
pg=(-h "$EAGLEOPS_PG_HOST" -p "$EAGLEOPS_PG_PORT" -U "$EAGLEOPS_PG_USER")
exists=$(psql "${pg[@]}" -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$name'")
if [[ "$exists" != 1 ]]; then
    createdb "${pg[@]}" "$name"
    echo "created database $name"
fi
