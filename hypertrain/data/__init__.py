"""The data: token windows and documents from text sources, speech, and the batches an update trains
on."""
