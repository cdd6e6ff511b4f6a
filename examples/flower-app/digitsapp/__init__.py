"""digitsapp: a Flower app of its own (model, data, training), audited by fedguard."""
