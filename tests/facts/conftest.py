"""A fresh PostgreSQL database per test (on the session's real server), so tests never see each other's rows."""

import uuid

import pytest


@pytest.fixture
def pg_url(postgres_url):
    import psycopg

    name = f"test_{uuid.uuid4().hex}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield postgres_url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')  # FORCE: a test may leave a connection open
