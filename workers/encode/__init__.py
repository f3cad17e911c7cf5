"""The encode role: images and audio clips to the thinker's input embeddings."""
