"""Tasks glue a data source, an objective and a model into per-token losses on packs."""
