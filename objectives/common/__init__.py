"""What several methods share: losses, held-out records, masked-LM preparation, the image and
speech methods' data and monitors, presets' pieces. No method is registered here."""
