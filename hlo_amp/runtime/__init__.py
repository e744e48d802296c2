"""Runtime half of hlo_amp: compiling rewritten modules and loss scaling."""
