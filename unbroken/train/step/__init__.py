"""The parts of a replica's step that the Manager drives: one attempt at the gradient exchange
(``exchange``) and its buffers and buckets during backward (``overlap``), the check that every
member received the same sums (``sdc_check``, judged by ``sdc_judge``), the replica's own commit
vote (``vote``), and live catch-up from a donor (``catch_up``). They import nothing above them in
``train``."""
