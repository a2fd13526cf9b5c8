"""train_draft: the stage (`stage`), training on the data host's nodes (`nodes`) and the streamed capture side (`stream`)."""
