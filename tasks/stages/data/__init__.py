"""generate_data: the stage (`stage`), its run on the data host (`host`) and its own regeneration servers (`regeneration`)."""
