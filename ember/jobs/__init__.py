"""Durable jobs: requests that found no capacity, kept until an instance has room and their result until it is read.

`store` holds the queue in one SQLite file (`JobStore`; `database` opens that file, checked, and moves a damaged
one aside; `wal` checks its write-ahead log before SQLite replays it); `postgres` holds the same queue in PostgreSQL,
shared by several nodes (`ember serve --jobs-url`).
"""
