"""flashsuite.common: what every version shares (validation, oracle, FLOP counts, test helpers,
architecture detection, the custom-op wrapper). Imports nothing from the versions."""
