"""API keys: `store` (the records, one JSON file under the state dir, and the ring a server reads them through) and
`postgres` (a cluster's keys in its shared job database); a Ray cluster's keys in its KV are `ember.cluster.keys_kv`.
"""
