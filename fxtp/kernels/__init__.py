"""fxtp's ground floor: what the rewritten programs, the passes and the API all stand on.
Nothing here imports from the passes or the API."""
