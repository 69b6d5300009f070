"""Checkpoints: storage on local disk, S3 and GCS, saves behind training, pretrained weights read into a
split model, and export to one file.
"""
