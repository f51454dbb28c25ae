"""Raw images to verified RecordIO: demo generator, index, image preparation, pack, verify."""
