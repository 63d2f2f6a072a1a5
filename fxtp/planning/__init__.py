"""Plans derived from a model's traced program (:func:`derive_plan`)."""
