"""A Flower App (quickstart layout) using graphfl's Flower-native strategies."""
