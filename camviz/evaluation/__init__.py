"""Is the map right: faithfulness metrics, pointing games, sanity checks, reports, a benchmark."""
