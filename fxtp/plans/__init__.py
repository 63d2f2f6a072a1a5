"""The plan vocabulary: parallel styles, plans matched against a model (fnmatch patterns,
Hugging Face plans, styles fxtp has no equivalent of, read off a meta copy) and the mesh."""
