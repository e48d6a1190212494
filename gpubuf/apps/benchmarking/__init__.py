"""What ``gpubuf bench`` and ``benchmarks/bench_{history,replay}.py`` run: gpubuf against its peers, same process.

:mod:`.timing` times contenders interleaved (medians); :mod:`.peers` says which peers import; :mod:`.history`
(HistoryBuffer vs a deque baseline), :mod:`.per` (prioritized insert/sample/update) and :mod:`.sequences` (window
sampling) build the contenders and return rows; :mod:`.report` turns rows into markdown, JSON and a PNG chart. A row is
``{"suite", "case", "op", "impl", "us", "bytes"}``: the median microseconds per call of one contender (``impl``) on one
op of one case, and the bytes that call produces."""
