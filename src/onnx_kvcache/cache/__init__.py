"""What a cache is: formats and granularities, attention operators, the sites a model holds, its layout."""
